"""Moved: the sweep is `fsdp-verify sweep` (fsdp_verify/commands/sweep.py), which ships with the
package. This shim forwards its arguments there, so old nightly scripts keep working:

    python bench/sweep.py --cases 1000 --out sweep-out   ==   fsdp-verify sweep --cases 1000 --out sweep-out
"""

import sys

from fsdp_verify.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["sweep", *sys.argv[1:]]))
