"""Errors raised below the training side too (compat's guarded loader), so they live where every part can import
them; and the YAML file reader whose failures name the flag that gave the file."""


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: missing, incomplete, crafted, or made by a run this one is not."""


def unknown_keys(given, known, what: str, hint: str) -> str | None:
    """The message refusing ``given``'s keys outside ``known`` (``what`` names the mapping, ``hint`` says where
    they belong), None when every key is known."""
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return None
    return f"{what} has unknown key(s) {', '.join(map(repr, unknown))}; {hint}"


def read_yaml(path: str, flag: str):
    """The content of the YAML file ``flag`` names; one it cannot read or parse is a ValueError naming both."""
    import yaml

    try:
        with open(path) as handle:
            return yaml.safe_load(handle)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read the file ({error.strerror}).") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{flag} {path} is not valid YAML: {' '.join(str(error).split())}") from None
