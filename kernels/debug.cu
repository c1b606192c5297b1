// Test helpers: a one-thread kernel that keeps the stream busy for a given number of clock
// cycles, used to prove that a host call returns without waiting for the device.
extern "C" __global__ void spin_cycles(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
