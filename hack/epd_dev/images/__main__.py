"""CLI: python -m epd_dev.images build [NAME ...] [--import-into CLUSTER_DIR] | status"""

import sys

from .build import main

sys.exit(main())
