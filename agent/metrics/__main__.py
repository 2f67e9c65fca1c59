import sys

from agent.metrics.service import main

sys.exit(main(sys.argv[1:]))
