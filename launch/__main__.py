"""`python -m numa_runtime.launch ...`: the numa-launch command."""
import sys

from numa_runtime.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
