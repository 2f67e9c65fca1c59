import sys

from agent.router.router import main

sys.exit(main(sys.argv[1:]))
