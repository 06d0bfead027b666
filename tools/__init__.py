"""tools: the agentlog command line and benchmark scripts."""
