import sys

from agent.front.front import main

sys.exit(main(sys.argv[1:]))
