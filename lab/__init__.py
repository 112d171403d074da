"""The GPipe lab: theory, a model zoo, experiments, replays and charts on top of the engine.

Shared by the Streamlit app, the notebooks and the reproduction CLI; it imports no UI framework.
"""
