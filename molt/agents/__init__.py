"""Agents: the Env contract and the loop that drives it; ChatAgent over an OpenAI endpoint."""

from molt.agents.base import AgentError, Env, Message, Result, SingleTurn, episode_classes
from molt.agents.chat import ChatTemplate
from molt.agents.episode import Episode, Segment, episode_rows, run_episode, run_group
from molt.agents.openai_server import ChatAgent, ChatServer
from molt.agents.tools import Tool, tool_parser
