// The engine's device-side bookkeeping, read from found_inf (stats[0]) without a host
// synchronisation:
//   update_scale   the loss-scale state machine of src/scaler.rs (torch.amp.GradScaler's
//                  _amp_update_scale_, with DeepSpeed's hysteresis and a positive floor) as a
//                  one-thread kernel, and the engine's applied-step counter;
//   count_steps    the per-parameter step counts of the optimizer (torch.optim's
//                  state['step']): +1 for every parameter of the step's work list when the step
//                  was applied.
// scaler = [scale, growth_tracker, hysteresis_left] (f32; the tracker and hysteresis are small
// integers, exact in f32); counters are int64, exact at any step count.
#include "multi_tensor.cuh"

extern "C" __global__ void update_scale(float* scaler, long long* applied_steps, const float* stats,
                                        float growth_factor, float backoff_factor, float growth_interval,
                                        float hysteresis, float min_scale, float max_scale, int dynamic) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const bool found_inf = stats[0] != 0.0f;
    if (!found_inf) *applied_steps += 1;                        // the optimizer step was applied
    if (!dynamic) return;
    float scale = scaler[0], tracker = scaler[1], hyst = scaler[2];
    if (found_inf) {
        tracker = 0.0f;
        if (hyst <= 1.0f) {
            scale = fmaxf(scale * backoff_factor, min_scale);   // back off, never below the floor
        } else {
            hyst -= 1.0f;                                       // tolerated (refilled only on growth)
        }
    } else {
        tracker += 1.0f;
        if (tracker >= growth_interval) {                        // grow, never to inf
            float grown = scale * growth_factor;
            if (isfinite(grown)) scale = fminf(grown, max_scale);
            tracker = 0.0f;
            hyst = hysteresis;
        }
    }
    scaler[0] = scale; scaler[1] = tracker; scaler[2] = hyst;
}

extern "C" __global__ void count_steps(long long* steps, const unsigned int* index, int n, const float* stats) {
    if (stats[0] != 0.0f) return;                               // skipped step: no count moves
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        steps[index[i]] += 1;
    }
}
