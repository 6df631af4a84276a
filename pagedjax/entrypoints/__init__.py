"""Entry points: the offline LLM class, the command line, the OpenAI-compatible server."""
