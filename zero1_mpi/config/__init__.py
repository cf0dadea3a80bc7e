"""An optimizer's configuration: the engine's options and their agreement across ranks.

- ``options.py``: every engine option declared once (name, type, default, check, help), and
  what is generated from the declarations (signatures, docstrings, docs, the agreed record).
- ``configure.py``: an optimizer's inputs checked and agreed on every rank before anything is
  allocated; the flat layout built and compared.
"""

__all__: list[str] = []
