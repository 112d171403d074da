"""The GPipe lab: the engine measured, replayed, drawn and taught.

Shared by the Streamlit app (app.py), the notebooks and the command line; it imports no UI
framework. Its parts, bottom layer first; a module imports only from layers below its own
(tests/test_layout.py holds it to LAYERS):

 0. machine/      the host: its GPUs, how its processes meet and are found, torchrun agents
 1. zoo/          the models, one file each with its card; theory.py, the paper's formulas and tables
 2. config.py     a run's settings and their checks, the app's defaults (no torch)
 3. processes/    stage processes: a pool driven from one process, and the children behind it
 4. runs/         one configuration in, one record out; the one way to make a step
 5. timelines/    a step's timeline replayed, taken apart and compared
 6. schedules/    schedules side by side, written by hand, found by search
 7. studies/      the paper's tables and what surrounds them; engine_time/, the engine's own costs
 8. views/        figures and tables; lessons/, the notebooks' checks; checkup/, the doctor's parts;
                  yours/, your own model's exactness, memory and plan
 9. the commands: bench.py, reproduce.py, doctor.py, train.py, check.py, grade.py (`python -m lab.<command>`)

Each package opens with its own reading map. docs/layout.md lists every module in this order.
"""

LAYERS = (("machine",), ("zoo", "theory"), ("config",), ("processes",), ("runs",), ("timelines",), ("schedules",),
          ("studies", "engine_time"), ("views", "lessons", "checkup", "yours"),
          ("bench", "reproduce", "doctor", "train", "check", "grade"))
