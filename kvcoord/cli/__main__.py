import sys

from kvcoord.cli import main

sys.exit(main())
