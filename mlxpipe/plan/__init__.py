"""The pure planner: which layers each rank runs, what it holds and fetches, whether it fits."""
