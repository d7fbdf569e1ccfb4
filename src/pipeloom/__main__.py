import sys

from pipeloom.cli import main

sys.exit(main())
