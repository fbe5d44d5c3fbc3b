"""A distilled corpus: the base model's own answers to a conversation source, grown chunk by chunk.

A corpus is a directory:

- ``manifest.json``: what it is (``format``), the source it answers (name, split, sha256 of the
  file), the base model that answered (name and sha256 of its weights), the generation settings,
  and the chunks in order;
- ``part-00000.jsonl.gz``, ``part-00001.jsonl.gz``, ...: each chunk's finished conversations in
  ShareGPT form (what ``draftheads distill`` writes), gzipped without a timestamp, so the same
  answers give the same bytes.

Chunk k answers the source's conversations ``start .. end - 1`` (in source order, after the
pipeline's normalisation), where its ``start`` is the previous chunk's ``end``: a corpus grows by
running the same command again, one chunk per run, on any day and any machine. While a chunk is
being distilled it is a plain ``part-0000k.jsonl`` appended to and flushed conversation by
conversation (an interrupted run resumes it), with a ``part-0000k.pending.json`` that fixes its
range; once every conversation is answered it is gzipped, hashed and recorded in the manifest.

The data pipeline reads a corpus directory like any local source (``data.source: DIR``): its
sealed chunks, in order, each checked against its recorded sha256 first.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from draftheads.data.sources import DataError
from draftheads.storage import file_sha256, write_text_atomically

FORMAT = "draftheads-corpus/1"
MANIFEST = "manifest.json"


class CorpusError(DataError):
    """A corpus directory, its manifest or a chunk is not what it should be (names which)."""


def tree_sha256(path: Path) -> str:
    """sha256 of a file, or of a directory's files (names and contents, sorted by name)."""
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class CorpusSettings:
    """What every chunk of a corpus shares: a later chunk made otherwise would not belong."""

    source: str  # as given to the pipeline: "sharegpt", a local file, or a dataset id
    source_sha256: str | None  # of the local file read (None for a dataset id)
    split: str
    base: str  # the base model as named (alias, Hub id, directory or .gguf)
    base_sha256: str  # of its weights: the .gguf file an alias names, or the model directory
    max_new_tokens: int
    max_length: int | None  # a conversation ends at the first turn whose prompt + answer would exceed it
    temperature: float
    dtype: str  # the base's, as decoded (greedy answers differ between float32 and bfloat16)
    # The sampling seed (answers at temperature > 0 are a function of it); None when greedy.
    # Manifests written before it was recorded are greedy, and read as None.
    seed: int | None = None
    # --template as given (auto | chat | plain); manifests written before it was recorded required
    # a chat template and used it, which auto resolves to for their base.
    template: str = "auto"


@dataclass(frozen=True)
class Chunk:
    """One sealed chunk: the source conversations ``start .. end - 1`` it answered and what it holds."""

    file: str
    start: int
    end: int
    conversations: int  # written (a conversation with no answer that fits is left out)
    answers: int
    answer_tokens: int  # tokens of the answers, re-tokenized with the base's tokenizer
    seconds: float  # distillation wall time, summed over the runs that made it
    engine: str  # hf or vllm
    sha256: str


def _from_dict(cls, data, where: str):
    """``cls(**data)`` with every field present (those with a default may be absent) and nothing
    else, or a CorpusError naming ``where``."""
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict):
        raise CorpusError(f"{where}: expected an object, got {type(data).__name__}")
    missing, unknown = required - data.keys(), data.keys() - names
    if missing or unknown:
        raise CorpusError(
            f"{where}: missing fields {sorted(missing) or 'none'}, unknown fields {sorted(unknown) or 'none'}"
        )
    return cls(**data)


@dataclass
class Corpus:
    directory: Path
    settings: CorpusSettings
    chunks: list[Chunk] = field(default_factory=list)

    # ---- reading ------------------------------------------------------------------------------

    @staticmethod
    def is_corpus(path: Path) -> bool:
        """Whether ``path`` is a corpus directory (a manifest with this format)."""
        manifest = Path(path) / MANIFEST
        if not manifest.is_file():
            return False
        try:
            return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False

    @classmethod
    def load(cls, directory: str | Path) -> Corpus:
        directory = Path(directory)
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CorpusError(f"{directory} is not a corpus: it has no {MANIFEST}") from None
        except ValueError as error:
            raise CorpusError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CorpusError(f"{path}: field 'format' is {found!r}, expected {FORMAT!r}")
        settings = _from_dict(CorpusSettings, data.get("settings"), f"{path} field 'settings'")
        chunks = data.get("chunks")
        if not isinstance(chunks, list):
            raise CorpusError(f"{path}: field 'chunks' must be a list, got {type(chunks).__name__}")
        chunks = [_from_dict(Chunk, c, f"{path} field 'chunks[{i}]'") for i, c in enumerate(chunks)]
        expected_start = 0
        for index, chunk in enumerate(chunks):
            if chunk.start != expected_start or chunk.end <= chunk.start:
                raise CorpusError(
                    f"{path}: field 'chunks[{index}]' covers {chunk.start}..{chunk.end}; "
                    f"it should start at {expected_start} and end after it"
                )
            expected_start = chunk.end
        return cls(directory, settings, chunks)

    def files(self, verify: bool = True) -> list[Path]:
        """The sealed chunks' files, in order; each checked against its sha256 (``verify``)."""
        paths = []
        for chunk in self.chunks:
            path = self.directory / chunk.file
            if not path.is_file():
                raise CorpusError(f"{self.directory / MANIFEST}: chunk file {chunk.file} is missing")
            digest = file_sha256(path) if verify else chunk.sha256
            if digest != chunk.sha256:
                raise CorpusError(
                    f"{path}: sha256 {digest} differs from the manifest's {chunk.sha256} "
                    "(the file changed after it was sealed)"
                )
            paths.append(path)
        return paths

    @property
    def next_start(self) -> int:
        """The first source conversation no sealed chunk covers."""
        return self.chunks[-1].end if self.chunks else 0

    def summary(self) -> str:
        conversations = sum(c.conversations for c in self.chunks)
        tokens = sum(c.answer_tokens for c in self.chunks)
        if not self.chunks:
            return f"{self.directory}: no chunks yet"
        return (
            f"{self.directory}: {len(self.chunks)} chunks, source conversations 0..{self.next_start - 1}, "
            f"{conversations} conversations written, {tokens} answer tokens"
        )

    # ---- growing ------------------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, directory: str | Path, settings: CorpusSettings) -> Corpus:
        """The corpus at ``directory`` if its settings equal ``settings`` (else a CorpusError naming
        the field that differs), or a new, empty one there."""
        directory = Path(directory)
        if not (directory / MANIFEST).exists():
            if directory.exists() and any(directory.iterdir()):
                raise CorpusError(f"{directory} holds files but no {MANIFEST}: give a new or empty directory")
            corpus = cls(directory, settings)
            corpus.save()
            return corpus
        corpus = cls.load(directory)
        for name, value in asdict(settings).items():
            recorded = getattr(corpus.settings, name)
            if recorded != value:
                raise CorpusError(
                    f"{directory / MANIFEST}: field 'settings.{name}' is {recorded!r}, this run's {value!r}; "
                    "a chunk made otherwise would not belong (start another corpus directory)"
                )
        return corpus

    def save(self) -> None:
        """Write the manifest atomically (a crash leaves the old one or the new one)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT,
            "settings": asdict(self.settings),
            "chunks": [asdict(c) for c in self.chunks],
        }
        write_text_atomically(self.directory / MANIFEST, json.dumps(data, indent=2) + "\n")

    def _pending_paths(self) -> tuple[Path, Path]:
        stem = f"part-{len(self.chunks):05d}"
        return self.directory / f"{stem}.jsonl", self.directory / f"{stem}.pending.json"

    def chunk_range(self, size: int) -> tuple[int, int]:
        """The source range ``(start, end)`` the next run answers: a pending chunk's own (an
        interrupted run resumes it), else the next ``size`` conversations. Records nothing."""
        _, pending = self._pending_paths()
        if pending.is_file():
            state = json.loads(pending.read_text(encoding="utf-8"))
            return state["start"], state["end"]
        return self.next_start, self.next_start + size

    def begin_chunk(self, size: int, engine: str) -> tuple[Path, int, int]:
        """The file to distill the next chunk into and its source range ``(path, start, end)``
        (``chunk_range``), recorded as pending so that an interrupted run resumes it."""
        path, pending = self._pending_paths()
        start, end = self.chunk_range(size)
        if not pending.is_file():
            state = {"start": start, "end": end, "seconds": 0.0, "engine": engine}
            write_text_atomically(pending, json.dumps(state) + "\n")
        return path, start, end

    def add_seconds(self, seconds: float, engine: str) -> None:
        """Count a run's distillation time towards the pending chunk (it may take several runs)."""
        _, pending = self._pending_paths()
        state = json.loads(pending.read_text(encoding="utf-8"))
        state["seconds"] += seconds
        if state["engine"] != engine:
            state["engine"] = "mixed"
        write_text_atomically(pending, json.dumps(state) + "\n")

    def seal_chunk(self, end: int, count_tokens) -> Chunk:
        """Gzip the pending chunk (source conversations up to ``end``, fewer than asked when the
        source ran out), hash it and record it. ``count_tokens(text) -> int`` counts answer tokens."""
        path, pending = self._pending_paths()
        state = json.loads(pending.read_text(encoding="utf-8"))
        raw = path.read_bytes() if path.is_file() else b""
        # JSON Lines end at "\n" only: str.splitlines would also split at U+2028 and the like,
        # which answers may hold raw (they are written with ensure_ascii=False).
        records = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]
        answers = [t["value"] for r in records for t in r["conversations"] if t["from"] == "gpt"]
        sealed = path.with_name(path.name + ".gz")
        with (
            open(sealed, "wb") as stream,
            gzip.GzipFile(fileobj=stream, mode="wb", mtime=0, filename="") as compressed,
        ):
            compressed.write(raw)
        chunk = Chunk(
            file=sealed.name,
            start=state["start"],
            end=end,
            conversations=len(records),
            answers=len(answers),
            answer_tokens=sum(count_tokens(a) for a in answers),
            seconds=round(state["seconds"], 1),
            engine=state["engine"],
            sha256=file_sha256(sealed),
        )
        self.chunks.append(chunk)
        self.save()
        path.unlink(missing_ok=True)
        pending.unlink()
        return chunk
