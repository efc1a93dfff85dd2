"""The checks on ``crisp-profile --out``, made before any work and again once the model is known.

crisp-profile is stricter than ``save_pack`` about ``--out``: it replaces only an older pack of the same
model, and refuses a folder holding anything else.
"""

from __future__ import annotations

from pathlib import Path

from crisp_runtime.storage.outputs import OutputPathError, check_writable_folder
from crisp_runtime.storage.pack import PACK_FILES, recorded_model

from ..calibration import CliError

# The fingerprint fields that must match for --out's pack to be replaced by this model's.
_SAME_MODEL_KEYS = ("hidden_size", "intermediate_size", "num_experts", "layer_ids")


def check_out_files(out: Path) -> dict | None:
    """Refuse an --out that is not a folder or holds anything besides a pack's own files (no model needed,
    so this runs before the model is loaded). Returns the model fingerprint of the pack found there, if any."""
    try:  # the pack is staged beside --out and swapped in: its parent must take new files
        check_writable_folder(f"--out {out}", out.parent)
    except OutputPathError as exc:
        raise CliError(str(exc)) from exc
    if not out.exists():
        return None
    if not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    if not any(out.iterdir()):
        return None
    existing = recorded_model(out)
    if existing is None:
        raise CliError(f"--out {out}: the folder is not empty and holds no CRISP pack; refusing to replace it")
    others = sorted(p.name for p in out.iterdir() if p.name not in PACK_FILES)
    if others:
        listed = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise CliError(f"--out {out}: beside the CRISP pack the folder holds other files ({listed}); refusing to "
                       f"replace it (give an empty or new folder)")
    return existing


def check_out_dir(out: Path, fingerprint: dict) -> None:
    """Refuse an --out that holds something other than an older pack of this same model (and only that)."""
    existing = check_out_files(out)
    if existing is None:
        return
    if existing.get("weights_sha256") != fingerprint["weights_sha256"] or any(
        existing.get(k) != fingerprint[k] for k in _SAME_MODEL_KEYS
    ):
        raise CliError(
            f"--out {out}: holds the pack of a different model ({existing.get('model_type')}, "
            f"weights {str(existing.get('weights_sha256'))[:12]}...); choose another --out or delete it"
        )
