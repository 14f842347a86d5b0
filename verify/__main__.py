"""`python -m fsdp_verify` and the `fsdp-verify` console script.

For `repro` (run by `git bisect run`), a toolkit that does not even import or parse at this
revision means "cannot test here": exit 125 (skip), never 1 or 2 ("bad")."""

import sys

INTERRUPTED = 130  # the shell's 128 + SIGINT


def entry() -> int:
    repro = sys.argv[1:2] == ["repro"]
    try:
        from fsdp_verify.commands.cli import main

        code = main()
    except KeyboardInterrupt:
        # Ctrl-C where no command handles it (`sweep` and `fuzz` write their report first):
        # the shell's exit status, no traceback
        print("fsdp-verify: interrupted (Ctrl-C)", file=sys.stderr)
        code = INTERRUPTED
    except SystemExit as e:
        return 125 if repro and e.code == 2 else e.code
    except Exception:
        if not repro:
            raise
        import traceback

        traceback.print_exc()
        print("fsdp-verify repro: the toolkit does not run at this revision (exit 125: skip)", file=sys.stderr)
        return 125
    if code == INTERRUPTED:
        # Interrupted and finished: Python puts SIGINT back to its default as it shuts down, and
        # a Ctrl-C landing there (a second press, or the first one late) would end the process
        # by the signal (-2) after the report said 130 (CI met one in `sweep`'s Ctrl-C test).
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    raise SystemExit(entry())
