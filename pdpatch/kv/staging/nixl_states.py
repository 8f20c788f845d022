"""Names of NIXL's Python agent API: the transfer states ``check_xfer_state`` answers, and the
agent name that prepares a list of local memory."""

DONE, PROC, ERR = "DONE", "PROC", "ERR"
INIT_AGENT = "NIXL_INIT_AGENT"
