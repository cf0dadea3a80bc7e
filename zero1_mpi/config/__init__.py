"""An optimizer's configuration: the engine's options and their agreement across ranks.

- ``options.py``: every engine option declared once (name, type, default, check, help), the
  checks run in order and the record the ranks agree on.
- ``generated.py``: what is generated from the declarations (signatures, ``help()``, the list
  of docs/api.md, ``repr(opt)``).
- ``configure.py``: an optimizer's inputs checked and agreed on every rank before anything is
  allocated; the flat layout built and compared.
"""

__all__: list[str] = []
