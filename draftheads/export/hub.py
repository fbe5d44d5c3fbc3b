"""Upload an exported head to the Hugging Face Hub (``HfApi.create_repo`` + ``upload_folder``)."""

from __future__ import annotations

from pathlib import Path

from draftheads.export.destination import MANIFEST_NAME


class HubError(RuntimeError):
    """Uploading to the Hugging Face Hub failed or cannot start (no token); says what to do."""


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, endpoint: str | None = None) -> str:
    """Upload ``folder`` to a Hub model repository (created if missing); returns the repo URL.

    The token comes from the usual places (``HF_TOKEN``, or ``hf auth login``); ``endpoint``
    defaults to ``HF_ENDPOINT`` / huggingface.co."""
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise HubError(
            "no Hugging Face token found: set HF_TOKEN or run `hf auth login` (a token with write access)"
        )
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload draftheads export",
            ignore_patterns=[MANIFEST_NAME],  # local bookkeeping for --overwrite, not for readers
        )
    except Exception as err:  # network, auth and validation errors all end the command the same way
        raise HubError(f"upload of {folder} to {repo_id} failed: {err}") from err
    return str(url)
