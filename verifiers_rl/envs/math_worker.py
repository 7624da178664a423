"""MathChecker's worker process: reads ``[gold, predicted]`` JSON lines on stdin and answers each with one JSON line
on stdout, ``{"equal": bool}`` or ``{"error": "..."}``. A standalone script: MathChecker runs its source with
``python -c``, so that the worker needs neither this package on its path nor the parent's main module."""

import json
import sys


def main() -> None:
    from math_verify import parse, verify

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        gold, predicted = json.loads(line)
        try:
            reply = {"equal": bool(verify(parse(f"${gold}$"), parse(f"${predicted}$")))}
        except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
