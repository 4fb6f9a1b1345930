"""Fails when a C++ or HIP source line is longer than 100 characters (DESIGN.md section 10)."""

import subprocess
import sys

LIMIT = 100
PATTERNS = ["csrc/*", "hip/*", "tests/fuzz/*"]


def main() -> int:
    files = subprocess.check_output(["git", "ls-files", *PATTERNS], text=True).split()
    long_lines = [
        f"{path}:{number}: {len(line)} characters"
        for path in files
        for number, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1)
        if len(line) > LIMIT
    ]
    print("\n".join(long_lines) or f"C++ lines within {LIMIT} characters ({len(files)} files)")
    return 1 if long_lines else 0


if __name__ == "__main__":
    sys.exit(main())
