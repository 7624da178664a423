"""Errors raised below the training side too (compat's guarded loader), so they live where every part can import them."""


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: missing, incomplete, crafted, or made by a run this one is not."""


def unknown_keys(given, known, what: str, hint: str) -> str | None:
    """The message refusing ``given``'s keys outside ``known`` (``what`` names the mapping, ``hint`` says where
    they belong), None when every key is known."""
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return None
    return f"{what} has unknown key(s) {', '.join(map(repr, unknown))}; {hint}"
