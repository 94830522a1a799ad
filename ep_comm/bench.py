"""``python -m ep_comm.bench``: the same as the ``ep-bench`` command."""
from ep_comm.cli.main import main

if __name__ == "__main__":
    main()
