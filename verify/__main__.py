"""`python -m fsdp_verify` and the `fsdp-verify` console script.

For `repro` (run by `git bisect run`), a toolkit that does not even import or parse at this
revision means "cannot test here": exit 125 (skip), never 1 or 2 ("bad")."""

import sys


def entry() -> int:
    repro = sys.argv[1:2] == ["repro"]
    try:
        from fsdp_verify.commands.cli import main

        return main()
    except SystemExit as e:
        return 125 if repro and e.code == 2 else e.code
    except Exception:
        if not repro:
            raise
        import traceback

        traceback.print_exc()
        print("fsdp-verify repro: the toolkit does not run at this revision (exit 125: skip)", file=sys.stderr)
        return 125


if __name__ == "__main__":
    raise SystemExit(entry())
