import sys

from silod.cli.main import main

sys.exit(main())
