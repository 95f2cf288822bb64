"""Agents: the Env contract and the generation loop that drives it."""

from molt.agents.base import AgentError, Env, Message, Result, SingleTurn
from molt.agents.chat import ChatTemplate
from molt.agents.episode import Episode, Segment, episode_rows, run_episode
