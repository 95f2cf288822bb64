"""The DAG runtime: stages, ports, edges, pipelines, the runner, placement, checkpoints, recordings
and metrics. It imports no RL package (agents, algorithms, engines, models, tasks, train)."""
