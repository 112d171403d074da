"""Views: figures and tables, shared by the app, the notebooks and `python -m lab.reproduce`.

Reading map:

1. `charts.py`   Plotly figures whose data says what they show (the tests read them back); no torch
2. `tables.py`   the speedup tables as DataFrames, the paper's beside this host's
3. `results.py`  what `python -m lab.reproduce` writes: markdown rows and one figure per command
"""
