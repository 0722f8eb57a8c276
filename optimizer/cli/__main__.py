"""``python -m optimizer.cli``: the same as the ``tapestry`` console script."""

from optimizer.cli import main

if __name__ == "__main__":
    main()
