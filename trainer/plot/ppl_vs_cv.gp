# The PPL-CV trade-off (the paper's Figure 2): one point per run, x = expert
# load CV at the end of the run (by default counts summed over its last
# `window` steps, CV per MoE layer, mean over layers), y = validation
# perplexity at its last evaluation; runs with the same label share a colour
# and marker, and the label is written beside the first of them (column
# 'first').
# Set by himoe-plot: out, format, datadir, window, labels (the distinct labels, by
# colour index; the data's colour column points into them), xlabel (optional:
# how the CV was taken).
W = 900; H = 550
if (format eq 'svg') {
  set terminal svg size W,H dynamic enhanced font 'sans,11' background rgb 'white'
} else {
  set terminal pngcairo size W,H enhanced font 'sans,10'
}
set output out
data = sprintf('%s/ppl_vs_cv.dat', datadir)

set title 'Perplexity vs. load imbalance (lower-left is better)' font ',13'
if (!exists('xlabel')) { xlabel = sprintf('expert load CV (last %d steps, mean over MoE layers)', window) }
set xlabel xlabel
set ylabel 'validation perplexity (last evaluation)'
set grid lc rgb '#dddddd'
set tics out nomirror
set offsets 0, graph 0.2, graph 0.1, graph 0.1
set xrange [0:*]
set key top left box opaque noenhanced samplen 1 spacing 1.3
array colours[8] = [0x1b9e77, 0xd95f02, 0x7570b3, 0xe7298a, 0x66a61e, 0xe6ab02, 0xa6761d, 0x666666]
array points[6] = [7, 5, 9, 11, 13, 15]
colour(i) = colours[(int(i) - 1) % 8 + 1]
# One series per label (the key), then each label beside its first point.
plot for [i=1:words(labels)] data using 'cv':(column('colour') == i ? column('ppl') : NaN) \
       with points pt points[(i - 1) % 6 + 1] ps 2 lc rgb colour(i) title word(labels, i), \
     data using 'cv':(column('first') > 0 ? column('ppl') : NaN):(stringcolumn('label')):(colour(column('colour'))) \
       with labels left offset 1.2,0.6 tc rgb variable font ',10' noenhanced notitle
