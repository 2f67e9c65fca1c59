import sys

from agent.worker.wrapper import main

sys.exit(main(sys.argv[1:]))
