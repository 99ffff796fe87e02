"""moed.daemon."""
