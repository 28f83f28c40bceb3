import sys

from backend.cli import main

sys.exit(main())
