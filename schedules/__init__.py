"""jpipe's built-in schedules, written in the same language a user would use.

Each module registers one schedule with `jpipe.register_schedule`; jpipe imports
them all the first time a schedule is looked up by name.
"""
