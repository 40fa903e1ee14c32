"""trainer/parallel"""
