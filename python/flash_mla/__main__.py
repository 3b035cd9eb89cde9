"""Command line: ``python -m flash_mla demo [--quick] [--backend auto|cpu|cuda]``."""

import sys


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo",):
        print("usage: python -m flash_mla demo [--quick] [--backend auto|cpu|cuda] [--seed N]", file=sys.stderr)
        return 2
    from .demo import main as demo_main

    return demo_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
