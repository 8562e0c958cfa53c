"""Stand-ins for device objects in CPU tests."""


class ManualEvent:
    """A device event the test completes by hand (``query`` as CUDA's: done or not yet)."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True
