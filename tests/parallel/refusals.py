"""Collect the ValueError messages of calls that should refuse their input (in spawned
workers, whose results must be plain data)."""


def value_error_messages(*calls) -> list:
    """Each call's ValueError message, or None where it raised nothing."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages
