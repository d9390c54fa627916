"""`python -m mncore_lightning`: the environment, and what `accelerator="mncore"` would pick."""

from .environment import report

if __name__ == "__main__":
    print(report())
