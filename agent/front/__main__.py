import sys

# The worker's start first, where the front decides it: before the event loop, dbus-next
# and the rest of the front are imported (agent.front.early).
from agent.front.early import begin

early = begin(sys.argv[1:])

from agent.front.front import main  # noqa: E402

sys.exit(main(sys.argv[1:], early))
