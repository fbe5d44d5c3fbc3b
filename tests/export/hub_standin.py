"""A local stand-in for the few Hugging Face Hub endpoints an upload touches.

It implements, on 127.0.0.1 in a thread, what ``HfApi.create_repo`` + ``HfApi.upload_folder`` call
(huggingface_hub ``hf_api.py`` / ``_commit_api.py``): ``POST /api/repos/create``,
``POST /api/models/{repo}/preupload/{revision}`` (answering "regular" for every file, so contents
travel inline in the commit instead of through LFS/Xet storage) and
``POST /api/models/{repo}/commit/{revision}`` (NDJSON: a header line, then one base64 file per line),
and ``POST /api/validate-yaml`` (the client checks a README.md's front matter before committing;
here it must parse as YAML, as the Hub requires).
Everything else answers 404 and is recorded, so a test sees any request it did not expect.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class HubRecord:
    """What arrived: created repos (with their privacy), committed files, and stray requests."""

    created: dict[str, bool] = field(default_factory=dict)  # repo_id -> private
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo_id -> path -> content
    authorizations: list[str] = field(default_factory=list)
    card_metadata: list[dict] = field(default_factory=list)  # parsed README.md front matter
    unexpected: list[str] = field(default_factory=list)


def _handler(record: HubRecord, port_holder: list[int]):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length)
            record.authorizations.append(self.headers.get("Authorization", ""))
            path = self.path.split("?")[0]
            base = f"http://127.0.0.1:{port_holder[0]}"
            if path == "/api/repos/create":
                data = json.loads(body)
                repo_id = (
                    f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                )
                # huggingface_hub 1.x+ sends "visibility"; older clients sent "private".
                record.created[repo_id] = data.get("visibility") == "private" or data.get("private") is True
                return self._reply(200, {"url": f"{base}/{repo_id}", "name": repo_id})
            if path == "/api/validate-yaml":
                import yaml

                content = json.loads(body)["content"]
                front = content.split("---\n")[1] if content.startswith("---\n") else ""
                try:
                    record.card_metadata.append(yaml.safe_load(front) or {})
                except yaml.YAMLError as err:
                    return self._reply(400, {"errors": [{"message": str(err)}]})
                return self._reply(200, {"warnings": []})
            parts = path.split("/")
            if path.startswith("/api/models/") and len(parts) >= 7 and parts[5] == "preupload":
                files = json.loads(body)["files"]
                return self._reply(
                    200,
                    {
                        "files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                        ]
                    },
                )
            if path.startswith("/api/models/") and len(parts) >= 7 and parts[5] == "commit":
                repo_id = f"{parts[3]}/{parts[4]}"
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        value = item["value"]
                        content = (
                            base64.b64decode(value["content"])
                            if value.get("encoding") == "base64"
                            else value["content"].encode()
                        )
                        record.files.setdefault(repo_id, {})[value["path"]] = content
                return self._reply(200, {"commitUrl": f"{base}/{repo_id}/commit/0000", "commitOid": "0" * 40})
            record.unexpected.append(f"POST {self.path}")
            return self._reply(404, {"error": "not in the stand-in"})

        def do_GET(self):
            if self.path.split("?")[0] == "/api/agent-harnesses":
                # huggingface_hub's best-effort user-agent lookup (utils/_detect_agent.py), not part
                # of the upload: answer with the empty registry it falls back to anyway.
                return self._reply(200, {"standardEnvVars": [], "harnesses": {}})
            record.unexpected.append(f"GET {self.path}")
            return self._reply(404, {"error": "not in the stand-in"})

    return Handler


class HubStandIn:
    """Context manager: ``with HubStandIn() as hub: ... hub.endpoint ... hub.record``."""

    def __init__(self):
        self.record = HubRecord()
        self._port: list[int] = [0]
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.record, self._port))
        self._port[0] = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port[0]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
