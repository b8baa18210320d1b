import sys

from moaspec.cli import main

sys.exit(main())
