"""What `GRPOTrainer.push_to_hub` (and `grpo-hf publish`) check before and around an upload to the Hugging Face Hub.

Tokens: an upload uses the token `huggingface_hub` finds (`HF_TOKEN`, `hf auth login`) and writes it nowhere; a
`hub_token` in the training arguments is refused ([`check_push_settings`]), because the Trainer pickles its arguments
into `training_args.bin`. Before uploading, every text file of the folder is checked for the token
([`refuse_token_in`]). A missing token, a refused one or an unreachable Hub gives one
[`~grpo_hf.errors.HubError`] ([`hub_errors`]); the folder stays for a retry.

Example:

```python
>>> from grpo_hf.hub_guards import check_push_settings, hub_errors
>>> check_push_settings(args)  # before any work: no hub_token in the arguments, a token to push with
>>> with hub_errors("me/model", "out"):
...     trainer.push_to_hub()
```
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .errors import HubError


_TEXT_SUFFIXES = {".json", ".md", ".txt", ".jinja", ".yaml", ".csv"}


def refuse_token_in(folder: str | Path, token: str | None) -> None:
    """Raise a [`HubError`] if `token` appears in a text file of `folder` (the token itself is never printed)."""
    if not token:
        return
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.suffix in _TEXT_SUFFIXES and token in path.read_text(errors="ignore"):
            raise HubError(f"{path} holds your Hugging Face token: remove it from that file; nothing was uploaded.")


def _unreachable(err: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(err, (OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    return type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "httpcore", "httpcore2")


@contextlib.contextmanager
def hub_errors(repo_id: str | None, folder: str | Path | None, retry: str | None = None):
    """Turn what the Hub raises (no token, refused token, unreachable, offline) into one [`HubError`]."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        yield
    except HubError:
        raise
    except Exception as err:
        token = get_token()
        text = str(err).split("\n")[0][:300].replace(token, "<token>") if token else str(err).split("\n")[0][:300]
        keep = f" The folder {folder} is intact" + (f": retry with `{retry}`." if retry else ".") if folder else ""
        if isinstance(err, OfflineModeIsEnabled):
            raise HubError(f"Cannot publish {repo_id}: HF_HUB_OFFLINE is set; unset it to upload.{keep}") from None
        if isinstance(err, HfHubHTTPError):
            status = getattr(getattr(err, "response", None), "status_code", None)
            why = {
                401: "the Hub refused the token (401): log in again with `hf auth login` or set a valid HF_TOKEN",
                403: "the token may not write to this namespace (403): use a token with write access",
            }.get(status, f"the Hub answered {status}: {text}")
            raise HubError(f"Cannot publish {repo_id}: {why}.{keep}") from None
        if _unreachable(err):
            raise HubError(
                f"Cannot publish {repo_id}: the Hub is unreachable ({type(err).__name__}: {text}). Check the network "
                f"(and HF_ENDPOINT).{keep}"
            ) from None
        raise


def require_token() -> None:
    """Raise a [`HubError`] when `huggingface_hub` finds no token (`HF_TOKEN`, `hf auth login`)."""
    from huggingface_hub import get_token

    if not get_token():
        raise HubError(
            "No Hugging Face token found: publishing needs one with write access. Run `hf auth login` or set the "
            "HF_TOKEN environment variable (never put it in hub_token: the Trainer pickles its arguments into "
            "training_args.bin)."
        )


def check_push_settings(args) -> None:
    """
    Before any work, when `args.push_to_hub` is set: refuse a `hub_token` in the arguments (the Trainer would save it
    in `training_args.bin` of every checkpoint and upload it) and require a token [`require_token`] can find.
    """
    if getattr(args, "hub_token", None):
        raise HubError(
            "hub_token is set in the training arguments: the Trainer saves its arguments, token included, into "
            "training_args.bin of every checkpoint and uploads it. Unset hub_token and log in with `hf auth login` or "
            "set HF_TOKEN instead."
        )
    if getattr(args, "push_to_hub", False):
        require_token()


__all__ = ["check_push_settings", "hub_errors", "refuse_token_in", "require_token"]
