import sys

from opforge_cli import main

sys.exit(main())
