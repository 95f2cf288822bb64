"""The DAG runtime: stages, ports and edges, pipelines and their runner, placement, checkpoints,
recordings and metrics. It imports no RL package (agents, algorithms, engines, models, tasks, train)."""
