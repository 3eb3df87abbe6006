"""``python -m crossflow_agent``: the same as the ``crossflow-agent`` console script."""

from crossflow_agent.cli import main

if __name__ == "__main__":
    main()
