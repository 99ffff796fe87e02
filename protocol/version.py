"""Protocol version: a daemon refuses a `hello` or any request whose major version differs."""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0
