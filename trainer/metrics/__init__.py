"""trainer/metrics"""
