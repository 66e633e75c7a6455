"""The gateway's round: which sequences draft and verify, the exchange with the services, and the policy."""
