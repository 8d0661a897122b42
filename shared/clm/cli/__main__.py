import sys

from clm.cli import main

sys.exit(main())
