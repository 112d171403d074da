"""The checkup `python -m lab.doctor` runs on a new host, apart from its command line.

Reading map:

1. `comparisons.py`   what every check trains, and how gradients and traces are compared
2. `subprocesses.py`  checks in processes of their own, bounded in time, with Ctrl-C passed on
3. `report.py`        --report: the commands after the rows, and the one markdown file to send back
"""
